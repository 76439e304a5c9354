"""The ZeRO checkpoint files shared by every stage and by `zero_to_fp32`.

`format` (the version-1 layout: what each rank's file holds and how fragments reassemble), `io`
(DeepSpeed's directory layout, atomic writes, finding the files), `progress` (the console progress bar).
"""
