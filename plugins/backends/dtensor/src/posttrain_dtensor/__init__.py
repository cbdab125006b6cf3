"""posttrain policy backend 'dtensor': FSDP2 and tensor parallel training on torch DTensor."""
