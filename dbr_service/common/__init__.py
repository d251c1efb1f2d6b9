"""Shared by every stage: errors, configuration, runtime paths, /proc and memory maps, ELF symbols
and hot-spot names, lifecycles, files read and written for clients, service events.
Imports nothing else of dbr_service.
"""
