"""pagedkv.model_runner"""
