"""``python -m lowrank_lit ...`` -- the entry point W&B sweep agents call."""

from lowrank_lit.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
