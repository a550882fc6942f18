"""The ways in: the command line and its signals, embedding in a host's loop, and
``corun.run``, which adds the optional parts a config asks for to the loop template.
"""
