"""Local training: the model, the data, inner AdamW steps and evaluation on the device."""
