"""Fixtures shared by every test module."""

from __future__ import annotations

from dnsserver import dns_server

__all__ = ["dns_server"]
