"""Helpers shared by paved's tests (fixtures, real servers started on loopback)."""
