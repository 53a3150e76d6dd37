"""Time of a step: FLOPs, collectives on the cluster's links, offload, and calibration profiles."""
