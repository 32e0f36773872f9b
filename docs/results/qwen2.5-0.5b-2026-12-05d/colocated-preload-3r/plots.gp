set terminal svg size 900,560 dynamic background rgb 'white'
set key outside right
set grid
set output 'throughput_vs_adapters.svg'
set title 'Output throughput vs distinct adapters (64 concurrent requests)'
set xlabel 'distinct adapters'
set ylabel 'output tokens/s'
set logscale x 2
plot 'plot-colocated-base-throughput.dat' using 1:2 with linespoints title 'colocated-base', 'plot-colocated-direft-throughput.dat' using 1:2 with linespoints title 'colocated-direft', 'plot-colocated-direftp-throughput.dat' using 1:2 with linespoints title 'colocated-direftp', 'plot-colocated-lora-throughput.dat' using 1:2 with linespoints title 'colocated-lora', 'plot-colocated-lorap-throughput.dat' using 1:2 with linespoints title 'colocated-lorap'
unset logscale x
set output 'latency_vs_load.svg'
set title 'Time to first token vs throughput (64 adapters; one point per load)'
set xlabel 'output tokens/s'
set ylabel 'TTFT p50 (ms)'
plot 'plot-colocated-base-latency.dat' using 1:2 with linespoints title 'colocated-base', 'plot-colocated-direft-latency.dat' using 1:2 with linespoints title 'colocated-direft', 'plot-colocated-direftp-latency.dat' using 1:2 with linespoints title 'colocated-direftp', 'plot-colocated-lora-latency.dat' using 1:2 with linespoints title 'colocated-lora', 'plot-colocated-lorap-latency.dat' using 1:2 with linespoints title 'colocated-lorap'
