"""Tiers: dumb page stores (gpu, cpu, disk, redis) behind two small protocols in `kvstore.tiers.base`."""
