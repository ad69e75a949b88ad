"""Adapters that let other serving engines use kvstrata's tiers (one subpackage per engine)."""
