// A Go crypto/tls peer for egressbox's tests: Go's record layer is the most lenient
// one we know (any first-record version below 0x1000, warning alerts skipped before
// the ClientHello), so it is the receiver the TLS name check is judged against.
//
//	tlsorigin serve CERT KEY   listen on 127.0.0.1 (port 0), print "port N", then one JSON
//	                           line per connection: the SNI a completed handshake saw, or
//	                           the error, and how many bytes arrived
//	tlsorigin judge FILE...    feed each file to a TLS server as a client's first bytes and
//	                           print one JSON line: whether its ClientHello was read, and
//	                           the server name Go saw in it
//	tlsorigin hello NAME       print (hex) the first flight of a Go TLS client for NAME
//
// Only loopback: the origin binds 127.0.0.1; judge and hello use in-memory pipes.
package main

import (
	"bufio"
	"crypto/tls"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"
)

// Per-connection deadline: a test's step never waits longer than this.
const ioTimeout = 15 * time.Second

var out = json.NewEncoder(os.Stdout)
var outMu sync.Mutex

func emit(v any) {
	outMu.Lock()
	defer outMu.Unlock()
	_ = out.Encode(v)
}

// countingConn counts the bytes the origin received, whatever TLS made of them.
type countingConn struct {
	net.Conn
	n atomic.Int64
}

func (c *countingConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	c.n.Add(int64(n))
	return n, err
}

func serve(certFile, keyFile string) error {
	cert, err := tls.LoadX509KeyPair(certFile, keyFile)
	if err != nil {
		return err
	}
	config := &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}
	listener, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	fmt.Printf("port %d\n", listener.Addr().(*net.TCPAddr).Port)
	for {
		raw, err := listener.Accept()
		if err != nil {
			return err
		}
		go handle(raw, config)
	}
}

type served struct {
	Event  string `json:"event"`
	SNI    string `json:"sni"`
	Bytes  int64  `json:"bytes"`
	Error  string `json:"error,omitempty"`
	Answer bool   `json:"answered"`
}

func handle(raw net.Conn, config *tls.Config) {
	counted := &countingConn{Conn: raw}
	defer counted.Close()
	_ = counted.SetDeadline(time.Now().Add(ioTimeout))
	conn := tls.Server(counted, config)
	if err := conn.Handshake(); err != nil {
		// Wait for the peer's close so the count is every byte it ever sent.
		_, _ = io.Copy(io.Discard, counted)
		emit(served{Event: "failed", Bytes: counted.n.Load(), Error: err.Error()})
		return
	}
	sni := conn.ConnectionState().ServerName
	line, err := bufio.NewReader(conn).ReadString('\n')
	answered := false
	if err == nil && line == "ping\n" {
		_, err = conn.Write([]byte("hello from go " + sni + "\n"))
		answered = err == nil
	}
	_ = conn.Close()
	emit(served{Event: "handshake", SNI: sni, Bytes: counted.n.Load(), Answer: answered})
}

var errStop = errors.New("stop after the ClientHello")

type judged struct {
	File  string `json:"file"`
	Hello bool   `json:"hello"`
	SNI   string `json:"sni"`
}

func judge(file string) (judged, error) {
	data, err := os.ReadFile(file)
	if err != nil {
		return judged{}, err
	}
	result := judged{File: file}
	config := &tls.Config{
		GetConfigForClient: func(hello *tls.ClientHelloInfo) (*tls.Config, error) {
			result.Hello = true
			result.SNI = hello.ServerName
			return nil, errStop
		},
	}
	server, client := net.Pipe()
	go func() {
		_, _ = client.Write(data)
		_ = client.Close()
	}()
	go func() { _, _ = io.Copy(io.Discard, client) }() // alerts the server sends back
	_ = server.SetDeadline(time.Now().Add(ioTimeout))
	_ = tls.Server(server, config).Handshake()
	_ = server.Close()
	return result, nil
}

func hello(name string) error {
	server, client := net.Pipe()
	defer server.Close()
	go func() {
		conn := tls.Client(client, &tls.Config{ServerName: name, InsecureSkipVerify: true})
		_ = conn.Handshake()
		_ = client.Close()
	}()
	_ = server.SetDeadline(time.Now().Add(ioTimeout))
	header := make([]byte, 5)
	if _, err := io.ReadFull(server, header); err != nil {
		return err
	}
	body := make([]byte, int(header[3])<<8|int(header[4]))
	if _, err := io.ReadFull(server, body); err != nil {
		return err
	}
	fmt.Println(hex.EncodeToString(append(header, body...)))
	return nil
}

func main() {
	var err error
	switch {
	case len(os.Args) == 4 && os.Args[1] == "serve":
		err = serve(os.Args[2], os.Args[3])
	case len(os.Args) >= 2 && os.Args[1] == "judge":
		for _, file := range os.Args[2:] {
			var result judged
			if result, err = judge(file); err != nil {
				break
			}
			emit(result)
		}
	case len(os.Args) == 3 && os.Args[1] == "hello":
		err = hello(os.Args[2])
	default:
		err = errors.New("usage: tlsorigin serve CERT KEY | judge FILE... | hello NAME")
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "tlsorigin:", err)
		os.Exit(1)
	}
}
