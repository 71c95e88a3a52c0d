"""pagedkv.proto"""
