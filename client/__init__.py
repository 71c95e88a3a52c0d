"""pagedkv.client"""
