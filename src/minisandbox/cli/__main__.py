"""`python -m minisandbox.cli`: the `minisandbox` command."""

from minisandbox.cli import main

if __name__ == "__main__":
    main()
