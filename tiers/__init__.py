"""Tiers: dumb page stores (gpu, cpu, disk, redis) behind one interface, `kvstore.tiers.base`."""
