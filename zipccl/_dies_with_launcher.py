"""Imported only by the fork server that zipccl.launch.spawn starts (its preload): the server
dies with the launcher, however the launcher dies, and so do the ranks forked from it, each of
which dies with the server. Without it a killed launcher's server would live on: its ranks hold
the pipe whose end would tell it to stop."""

from .launch import _die_with_launcher

_die_with_launcher()
