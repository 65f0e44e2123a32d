"""`python -m mla_tune ...` runs the CLI (for machines where the console script is not installed)."""

from mla_tune.cli import main

main()
