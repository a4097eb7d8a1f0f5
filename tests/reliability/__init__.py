"""Reliability suite (issue 9): load, faults and bad input against a real server on loopback."""
