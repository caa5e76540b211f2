"""`python -m moe_eqx.launch`: run the demo as several `jax.distributed` processes on
this machine. The launcher lives in [`moe_eqx.train.launch`][]; see
`python -m moe_eqx.launch --help`."""

import sys

from .train.launch import build_parser as build_parser, launch as launch, main as main

if __name__ == "__main__":
    sys.exit(main())
