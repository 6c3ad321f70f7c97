"""Adapters that let inference engines use kvstore through their own extension points."""
