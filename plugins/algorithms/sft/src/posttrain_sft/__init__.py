"""posttrain algorithm 'sft': supervised fine-tuning."""
