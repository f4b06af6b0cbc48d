"""``python -m benchmarks.gpu_stack``: see the package docstring and ``--help``."""
from .cli import main

main()
