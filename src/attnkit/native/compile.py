"""The child process of `attnkit.native.build`: compile the kernels into a build folder.

python -m attnkit.native.compile BUILD_DIR NAME MODE
"""

from __future__ import annotations

import sys
from pathlib import Path

from attnkit.native.build import SANITIZE, SOURCES, flags


def compile_sources(build_dir: str, name: str, mode: str) -> None:
    """Compile the sources into `build_dir/name.so` with PyTorch's extension builder."""
    from torch.utils import cpp_extension

    here = Path(__file__).parent
    cpp_extension.load(
        name=name,
        sources=[str(here / s) for s in SOURCES],
        extra_cflags=flags(mode),
        extra_ldflags=["-fopenmp", *(SANITIZE if mode == "sanitize" else [])],
        build_directory=build_dir,
        is_python_module=False,
        verbose=False,
    )


if __name__ == "__main__":
    compile_sources(*sys.argv[1:4])
