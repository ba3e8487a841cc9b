"""The WAN testbed: network namespaces, shaped links, NAT routers, real daemons."""
