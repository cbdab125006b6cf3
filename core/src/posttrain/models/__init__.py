"""Model folders: checking a Hugging Face folder before any worker starts, and building
tiny seeded models locally (tests, the quickstart, benchmarks)."""
