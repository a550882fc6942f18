"""Scale-out: the torchrun launcher, a local Ray cluster, Ray rollout workers."""
