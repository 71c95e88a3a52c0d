"""pagedkv.daemon.core"""
