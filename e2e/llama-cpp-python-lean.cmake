# Included by llama.cpp's own project() call when e2e/build-llama-cpp.sh builds llama-cpp-python's wheel
# (CMAKE_PROJECT_llama.cpp_INCLUDE): llama-cpp-python's CMakeLists forces llama.cpp's "common" library on
# (LLAMA_BUILD_COMMON ... FORCE, so a -D flag cannot turn it off), and with it cpp-httplib; its Python loads
# only libllama and libggml*, never libllama-common, so both were compiled for nothing. Set here, after
# that FORCE and before llama.cpp reads the option.
set(LLAMA_BUILD_COMMON OFF CACHE BOOL "llama.cpp common library: not loaded by llama-cpp-python" FORCE)
