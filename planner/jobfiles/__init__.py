"""Job files in: torchtitan, accelerate, HF Trainer / TRL, Axolotl and LLaMA-Factory configs read
into one EstimateRequest (planner/jobfiles/job.py), each format by its own module with its table of
keys (planner/jobfiles/keys.py: modelled, inert with a reason, or refused by name)."""
