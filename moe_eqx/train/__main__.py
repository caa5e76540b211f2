"""`python -m moe_eqx.train`: the same as `python -m moe_eqx.demo`."""

from .cli import main

if __name__ == "__main__":
    main()
