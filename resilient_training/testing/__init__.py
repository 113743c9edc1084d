"""Offline stand-ins for the edges the cluster path talks to (Kubernetes API, CRD admission).

Used by this repository's tests and usable by anyone who wants to exercise the cluster path
without a cluster; nothing in the product imports them.
"""
