"""The pool service around the core: sessions, tenants, holds, limits and the work and answer
budgets of one call; free of gRPC.
"""
