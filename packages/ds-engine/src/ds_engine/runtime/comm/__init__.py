"""`deepspeed.runtime.comm`: DeepSpeed's runtime collectives package (`coalesced_collectives`)."""
