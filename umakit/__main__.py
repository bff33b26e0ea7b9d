"""`python -m umakit ...`: the `umakit` command, for an environment whose scripts are not on PATH."""

from umakit.cli.main import main

main(prog_name="umakit")
