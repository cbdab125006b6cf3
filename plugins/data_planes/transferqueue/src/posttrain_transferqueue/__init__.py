"""posttrain data plane 'transferqueue': a step's batch held in TransferQueue storage, the driver keeping only metadata."""
