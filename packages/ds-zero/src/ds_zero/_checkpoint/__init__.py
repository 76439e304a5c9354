"""The ZeRO checkpoint files shared by every stage, by `zero_to_fp32` and by `to_deepspeed`.

`format` (the version-1 layout: what each rank's file holds and how fragments reassemble), `io`
(DeepSpeed's directory layout, atomic writes, finding the files), `progress` (the console progress bar),
`partition_files` (reading every rank's partition file, ds's or DeepSpeed's, with restricted unpickling),
`deepspeed_format` / `deepspeed_export` (DeepSpeed 0.19.8's partition layout, read and written),
`deepspeed_files` (a rank's DeepSpeed model-states and optimizer files from a ds save: `to_deepspeed` and
the engine's `checkpoint.layout: "deepspeed"`),
`script_copy` and `standalone_zero_to_fp32` (the torch-only script placed next to each checkpoint).
"""
