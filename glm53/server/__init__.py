"""glm53.server"""
