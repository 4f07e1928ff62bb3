"""Adapters with the APIs engines already call (DeepEP's ``Buffer``), backed by moecomm."""

from moecomm.compat import deep_ep

__all__ = ["deep_ep"]
