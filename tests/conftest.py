"""The tests price with the built-in cost table of one kind of CPU (avx2's), so that no
choice of `auto` depends on the machine they run on (`attnkit.call.calibrate`: every other
kind has its own table); `tests/test_calibrate.py` tries the others and measures.

`ATTNKIT_TEST_CALIBRATION=on` runs them priced as a user's process would be instead (the
table `attnkit calibrate` kept here, else the one built in for this CPU's kind; the
exactness matrices must pass either way; tests of `auto`'s choices assume the avx2 table
and may then differ).
"""

from __future__ import annotations

import os

if os.environ.get("ATTNKIT_TEST_CALIBRATION", "off") != "on":
    os.environ["ATTNKIT_CALIBRATION"] = "avx2"


# the native kernels `make test` built, found by every test's child process too (several
# move $XDG_CACHE_HOME, where they are kept by default, to a folder of their own)
def _native_dir() -> str:
    from attnkit.native.build import cache_dir

    return str(cache_dir())


os.environ.setdefault("ATTNKIT_NATIVE_DIR", _native_dir())
