"""torch: DDP and FSDP2 of one torch version per module (v2), and torchtitan's
TOML config of a layout."""
