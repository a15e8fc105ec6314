"""Helper scripts; a package only so that tests can `from scripts.netlab import NetLab`."""
