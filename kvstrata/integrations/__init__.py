"""Engines that use kvstrata from the outside (SGLang HiCache L3). Nothing below imports this."""
