"""Where work runs: lanes (threads or inline), cores, guest mode on a host's loop,
child processes, the torchrun world and its collectives.
"""
