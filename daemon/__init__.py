"""pagedkv.daemon"""
