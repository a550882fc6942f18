"""The ways in: the command line and its signals, embedding in a host's loop, prerequisite runs."""
