"""glm53.transport"""
