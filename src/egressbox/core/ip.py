"""The address and network types every floor names, declared once.

Pure and cheap to import (no table, no regular expression): the modules that only
name the type in their signatures do not pay for `hosts` or `addresses`.
"""

from __future__ import annotations

import ipaddress

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
