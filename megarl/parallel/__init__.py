"""megarl.parallel"""
