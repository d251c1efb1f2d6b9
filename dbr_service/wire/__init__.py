"""The agent connection: the protocol's Python mirror (shared/dbr_protocol.h), framing and
handshake, and the connection as the installer uses it, replies checked.
"""
