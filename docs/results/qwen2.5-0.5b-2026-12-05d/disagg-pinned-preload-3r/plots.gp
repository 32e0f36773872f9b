set terminal svg size 900,560 dynamic background rgb 'white'
set key outside right
set grid
set output 'throughput_vs_adapters.svg'
set title 'Output throughput vs distinct adapters (64 concurrent requests)'
set xlabel 'distinct adapters'
set ylabel 'output tokens/s'
set logscale x 2
plot 'plot-disaggregated-base-throughput.dat' using 1:2 with linespoints title 'disaggregated-base', 'plot-disaggregated-direft-throughput.dat' using 1:2 with linespoints title 'disaggregated-direft', 'plot-disaggregated-direftp-throughput.dat' using 1:2 with linespoints title 'disaggregated-direftp', 'plot-disaggregated-lora-throughput.dat' using 1:2 with linespoints title 'disaggregated-lora', 'plot-disaggregated-lorap-throughput.dat' using 1:2 with linespoints title 'disaggregated-lorap'
unset logscale x
set output 'latency_vs_load.svg'
set title 'Time to first token vs throughput (64 adapters; one point per load)'
set xlabel 'output tokens/s'
set ylabel 'TTFT p50 (ms)'
plot 'plot-disaggregated-base-latency.dat' using 1:2 with linespoints title 'disaggregated-base', 'plot-disaggregated-direft-latency.dat' using 1:2 with linespoints title 'disaggregated-direft', 'plot-disaggregated-direftp-latency.dat' using 1:2 with linespoints title 'disaggregated-direftp', 'plot-disaggregated-lora-latency.dat' using 1:2 with linespoints title 'disaggregated-lora', 'plot-disaggregated-lorap-latency.dat' using 1:2 with linespoints title 'disaggregated-lorap'
