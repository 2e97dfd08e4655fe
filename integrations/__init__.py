"""Thin adapters from training frameworks to the lazyckpt engine."""
