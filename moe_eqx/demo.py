"""`python -m moe_eqx.demo`: train a small MoE language model on synthetic token
sequences. The application lives in [`moe_eqx.train`][] (this module keeps the command
and `main` where they were); see `python -m moe_eqx.demo --help`."""

from .train.cli import build_parser as build_parser, main as main

if __name__ == "__main__":
    main()
