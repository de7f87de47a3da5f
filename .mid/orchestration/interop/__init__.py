"""Hugging Face interop: a model initialised from a safetensors checkpoint directory (config.json, *.safetensors,
model.safetensors.index.json) and a run's checkpoint exported to one.

layout.py    which Hugging Face tensor holds which of our parameters, and config.json <-> our model arguments (pure)
files.py     reading and checking a checkpoint directory without loading it; writing safetensors shards streamed
import_hf.py filling a (maybe FSDP2-sharded) model from a directory, each rank reading only the rows it holds
export_hf.py a DCP checkpoint of a run written as a directory, one tensor in memory at a time
config_check.py  model=from_hf and model.init_from checked when the config loads, before Ray
"""
