"""Where a run stands, read from the durable files its stages leave."""
