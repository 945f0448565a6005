"""For learners: `attnkit tour` (`tour`), the `attnkit bench` comparison with PyTorch's
SDPA (`benchmark`) and the command's console (`console`: drawings, progress, a quiet
exit on a closed pipe).
"""
